"""One node's machinery: torchrun per attempt, the telemetry intake, merging rank reports
into steps (exact below 64 ranks, sketched above), stack dumps and incident folders.
"""
