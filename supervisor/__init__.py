"""babysit's supervisor: the process that launches, watches and steers a training job.

Rooms, lowest first (``docs/architecture.md`` draws them)::

    contract/   what a rank and its supervisor agree on: wire format, directive, control file
    rank/       runs inside a training rank: the worker API, saving, SDC fingerprints
    services/   the run's helpers that talk outwards: alerts, scheduled jobs, health, /metrics
    config/     what the user asked for: the run config's schema and the resolved plan
    node/       one node's machinery: torchrun, telemetry intake, step aggregation, stacks
    run/        one run's story: the loop, its judgement (watch), recovery, journal, cadence
    cluster/    several nodes: the authenticated channel, the leader's side, followers
    commands/   the command line: run, status, report, doctor, ...

A module imports from its own room and the rooms listed before it, never from one after it
(``policies/`` and ``checkpoints/`` sit below them all and import no room): the worker API stays
free of the supervisor's dependencies, and the run never reaches into the command line.
``tests/test_layers.py`` keeps it so, and keeps the package free of import cycles.
"""
