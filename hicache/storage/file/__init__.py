"""The file L3 backend: one file per object, its format, index and rescan."""
