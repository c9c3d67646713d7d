"""Axon's library code shared by every service: settings, logging, wire schemas, names, clients."""
