"""`tpupod dashboard`: one live page for pods, runs, serving and jobs.

The data comes from the library calls the CLI uses (state, run records, the job store, the
serving fleet's status); a sampling process asks the workers at a fixed interval for every
viewer at once; pages are rendered on the server (Jinja2) and kept live by one small script
over server-sent events. See docs/ARCHITECTURE.md.
"""
