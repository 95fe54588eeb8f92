"""The federated round engine (`engine`), run directories (`session`), checkpoints and client state.

Nothing is imported here on purpose: methods and distillation import the leaf modules (`local`, `seeds`,
`store`) while the engine imports methods and distillation, so re-exporting the engine from this package
would make every `import peradapt.personalize` go round in a circle.
"""
