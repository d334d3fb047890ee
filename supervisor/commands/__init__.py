"""The command line: ``babysit run`` and the commands that read a run's files
(``status``, ``report``) or check it before it starts (``doctor``, ``validate``).
"""
