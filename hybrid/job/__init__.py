"""The pretraining job's assembly: the entry point, the CLI, the checks that run before any
process group, the dry run, and when the job saves, resumes and stops.

The job wing uses every other package of ``hybrid``; nothing outside it imports it.
"""
