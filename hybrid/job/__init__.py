"""The pretraining job's assembly: the entry point, the CLI, the checks that run before any
process group, and when the job saves, resumes and stops.

The job wing uses the lower floors of ``hybrid`` and the planner; below it nothing imports it.
Only the dry run (``hybrid.dryrun``), which builds a validated job, and the entry point
``hybrid.pretrain``, which starts the job or the dry run, stand above it.
"""
