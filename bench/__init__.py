"""The load tester (loadtest.py and its parts, no torch) and the peer benchmark: systems.py runs the
systems, figures.py turns their runs into a report, report.py prints and plots it (no torch); output.py
writes progress and tables with or without a terminal. bench/README.md lists every module."""
