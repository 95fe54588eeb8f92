"""The top of the training stack: a run's session (data, model, trainer, method built from its config), the one
round loop (`engine`) that both engines share, and experiment tracking. Everything it drives lives below it:
methods, distillation, evaluation, the client-side compute (`peradapt.compute`) and the run-directory files
(`peradapt.rundir`)."""
