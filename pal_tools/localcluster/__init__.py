"""A Pal cluster of real processes on one machine: a throwaway PostgreSQL, an S3 server,
control-plane replicas and nodes. Used by the cluster tests, `pal bench cluster` and
scripts/cluster-demo.sh; never by a production deployment (see docs/deploy.md)."""
