"""The byte counter's import path in the examples; it lives in `dad_integrations.comm.counter`."""
from dad_integrations.comm.counter import *  # noqa: F401,F403
from dad_integrations.comm.counter import CollectiveCounter  # noqa: F401
