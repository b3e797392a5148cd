"""The one test harness that tests and benchmarks import (testbed, daemon runner, clients,
capture, VM runner, in-memory fakes)."""
