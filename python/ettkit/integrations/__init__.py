"""ettkit where people already train: each module here adapts one framework, and imports it only when used.

- :mod:`ettkit.integrations.hf_export`: a committed step as a Hugging Face model directory
  (``ettkit export STEP --format hf OUT``); needs neither ``transformers`` nor a process group.
- :mod:`ettkit.integrations.lightning`: a Lightning ``CheckpointIO`` backed by ``AsyncCheckpointer`` and an
  ETT ``Callback``.
- :mod:`ettkit.integrations.hf_trainer`: a ``transformers.TrainerCallback`` for ETT phases and async saves
  through ettkit, with resume from ettkit's newest step.

docs/integrations.md shows each in use and what was tested.
"""
