"""The governor's name for its configuration (`/etc/nodeforge/gang.yaml`).

The parser lives in the core (nodeforge/gang_config.py): the agent validates and writes a
controller's `gang` params with it, and the agent does not import the gang package.
"""

from nodeforge.gang_config import (
    DEFAULT_PATH,
    MAX_PROBE_BYTES,
    ConfigError,
    Deadlines,
    GangConfig,
    Gangs,
    Probe,
    Requeuing,
    from_dict,
    load,
)

__all__ = [
    "DEFAULT_PATH",
    "MAX_PROBE_BYTES",
    "ConfigError",
    "Deadlines",
    "GangConfig",
    "Gangs",
    "Probe",
    "Requeuing",
    "from_dict",
    "load",
]
