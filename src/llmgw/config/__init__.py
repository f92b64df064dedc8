"""Configuration files into frozen attrs classes, with errors that name file, key and value."""
