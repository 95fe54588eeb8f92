"""What the commands do, above the training stack: train on the engine the config names (`training`), make a
backbone offline (`pretraining`), search a method's settings (`tuning`), and on finished runs: evaluate and export one
(`finished_run`), personalize a new client (`newclients`), report and compare runs (`reports`, `comparison`,
`estimate` for --dry-run), model cards (`cards`) and pushing an export to the Hub (`share`)."""
