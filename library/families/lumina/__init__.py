"""The Lumina Image 2.0 family: `family.py` holds its ModelFamily class; the other modules are named by role."""
