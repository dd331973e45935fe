"""The benchmarks behind `rose bench NAME [--quick] --json OUT`."""
