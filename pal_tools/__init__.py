"""Tools beside the product, not part of it: the benchmarks (`pal bench`, bench/) and a
local cluster of real processes for tests and demos (localcluster/). They drive Pal from
outside, as an operator would; nothing in pal/ imports them but `pal bench` (the
import-linter contract `tools-beside`, pyproject.toml)."""
