"""The commands on a finished run: evaluate and export it (`finished_run`), personalize a new client
(`newclients`), report and compare runs (`reports`), model cards (`cards`) and pushing an export to the Hub
(`share`)."""
