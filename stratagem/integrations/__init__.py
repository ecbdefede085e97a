"""Integrations with third-party trainers.

Each integration is its own module and imports its trainer only there, so
``import stratagem`` never pulls one in: ``import stratagem.integrations.mmengine``
prepares stratagem for mmengine's ``FlexibleRunner``. ``model_api`` (no third-party
import) gives a wrapped model the ``train_step`` / ``val_step`` / ``test_step`` of the
module inside it, as a host trainer's loop calls them.
"""
