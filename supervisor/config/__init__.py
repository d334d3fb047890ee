"""What the user asked for: the run config's schema (one YAML file per run) and the
resolved ``RunPlan`` that every other room reads.
"""
