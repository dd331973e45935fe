"""Event-driven cluster simulator: ROSE against resource-fixed and resource-elastic baselines.

`rose simulate --list`; `rose simulate --scenario paper-8b [--json OUT] [--plot OUT.png]
[key=value ...]`. Modules: costs (cost models), workloads (RL demand), serving (serving
replicas under a trace), rollout (trajectories on workers), engine (the shared core),
systems (the policy differences), scenarios (configs), runner (runs them: figures), plots, cli.
"""
