"""One run's story: the control loop, its judgement (``Watch``), where a relaunch resumes
(``Recovery``), checkpoint cadence, the journal, progress and the console.
"""
