"""The wire layer's definitions: the versioned `.proto` files under tinydist/v1/ (shipped in the wheel as
package data, read with `importlib.resources.files("tinydist.proto")`) and generate.py, which compiles them
into transports/pci_remote/_generated/ and scheduler/_generated/."""
