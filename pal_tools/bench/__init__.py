"""`pal bench`: the benchmarks behind docs/benchmarks/, measured through the public API.

latency.py is `pal bench` itself (the runtime latency table: its rows in latency_rows.py,
its report in latency_report.py, its floors in floors.py); common.py and server.py hold
what every benchmark shares (timing, percentiles, the machine; the `pal up` it starts);
cluster, images, network, peer, s3, steady and wait are its subcommands' sections
(docs/benchmarks/*.md)."""
