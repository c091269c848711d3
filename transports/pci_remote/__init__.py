"""The remote device wire protocol: the protobuf modules generated from
proto/tinydist/v1/device.proto (_generated/) and the one-copy framing of bulk data (wire). Its
client is tinydist.runtime.remote, its server nodes/."""
