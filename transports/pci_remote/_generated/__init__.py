"""Generated from proto/tinydist/v1/*.proto by proto/generate.py; do not edit."""
