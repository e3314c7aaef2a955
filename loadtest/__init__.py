"""Load tests of the `neo` model over Triton gRPC streaming: locust user, workloads, summary and chart.

`python -m loadtest` (what `make loadtest` runs) drives a running server headless and writes its results to
`loadtest/results/`; `locustfile.py` is also usable with locust's own command line and web UI.
"""
