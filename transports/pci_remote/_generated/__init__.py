"""Generated from proto/tinydist/v1/device.proto by proto/generate.py; do not edit."""
