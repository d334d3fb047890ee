"""What a rank and its supervisor agree on: the telemetry wire format, the attempt's
directive, and the control file. Both sides import this room; it imports neither.
"""
