"""Event-driven cluster simulator: ROSE against resource-fixed and resource-elastic baselines.

`rose simulate --list`; `rose simulate --scenario paper-8b [--json OUT] [--plot OUT.png]
[key=value ...]`. Modules: costs (cost models), workloads (RL demand), serving (serving
replicas under a trace), rollout (trajectories on workers), workers (the replicas by kind),
engine (the shared core: the RL step loop and a round's ticks), dispatch (turns through the
routing table), provisioning (spot, serverless and serving capacity per step), coserving
(admission and capacity reports on serving replicas), burst (their memory), rates (dedicated
replicas' rates), systems (the policy differences), scenarios (configs), runner (runs them:
figures), plots, cli.
"""
