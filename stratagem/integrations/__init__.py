"""Integrations with third-party trainers.

Each integration is its own module and imports its trainer only there, so
``import stratagem`` never pulls one in: ``import stratagem.integrations.mmengine``
prepares stratagem for mmengine's ``FlexibleRunner``.
"""
