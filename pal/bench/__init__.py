"""`pal bench`: the benchmarks behind docs/benchmarks/, measured through the public API.

latency.py is `pal bench` itself (the runtime latency table) and holds the helpers the
others share; cluster, images, network, peer, s3, steady and wait are its subcommands'
sections (docs/benchmarks/*.md)."""
