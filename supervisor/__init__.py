"""babysit's supervisor: the process that launches, watches and steers a training job.

Rooms, from the training rank outwards (``docs/architecture.md`` draws them)::

    rank/       runs inside a training rank: the worker API, saving, SDC fingerprints
    contract/   what a rank and its supervisor agree on: wire format, directive, control file
    config/     what the user asked for: the run config's schema and the resolved plan
    services/   the loop's helpers: alerts, scheduled jobs, health sampling, /metrics
    node/       one node's machinery: torchrun, telemetry intake, step aggregation, stacks
    run/        one run's story: the loop, its judgement (watch), recovery, journal, cadence
    cluster/    several nodes: the authenticated channel, the leader's members, followers
    commands/   the command line: run, status, report, doctor, ...

A module imports from its own room or from rooms above it in this list, never below: the
worker API stays free of the supervisor's dependencies, and the run never reaches into the
command line. ``tests/test_layers.py`` keeps it so.
"""
