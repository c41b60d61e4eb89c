"""Code generated from pal/e2b/proto by scripts/gen-e2b-proto.sh: never edit by hand."""
