"""Devices, queues, timelines, buffers and the engine that runs them."""

from tinydist.runtime.allocator import Allocator, AllocatorStatistics
from tinydist.runtime.buffer import Buffer
from tinydist.runtime.clock import Clock, SystemClock
from tinydist.runtime.command_queue import CommandQueue
from tinydist.runtime.device import Batch, Completion, Device, DeviceState
from tinydist.runtime.engine import Engine, get_engine
from tinydist.runtime.program import Program
from tinydist.runtime.registry import DeviceInfo, canonical_name, discover, open_device
from tinydist.runtime.timeline import Timeline

__all__ = ["Allocator", "AllocatorStatistics", "Batch", "Buffer", "Clock", "CommandQueue", "Completion", "Device", "DeviceInfo",
           "DeviceState", "Engine", "Program", "SystemClock", "Timeline", "canonical_name", "discover", "get_engine", "open_device"]
