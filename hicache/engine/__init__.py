"""The engine (docs/DESIGN.md, "engine"): `Engine`, where a rank's scheduler runs and how the engine front
talks to it, above the scheduler (hicache/scheduler/) and below the server and the benchmark.

- `engine`: `Engine`, the offline and serving front (tokenize, validate, request handles); it picks a
  runtime and talks to it only through the `Runtime` protocol (`base`).
- `local`: one rank, the scheduler on a thread of this process.
- `rank_front`, `launch`, `rank_worker`: several ranks, one process each (spawned here, on follower
  nodes, or by torchrun), in lockstep; the front pumps rank 0's events back and watches the ranks.
- `build`: one rank's scheduler from the configuration; `commands`: the control commands, declared once;
  `snapshot`: every counter a scrape reads, from one command.
"""
