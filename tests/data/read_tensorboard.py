"""Reads every scalar of a TensorBoard log directory with TensorBoard's own reader.

Usage: read_tensorboard.py LOG_DIR; prints {tag: [[step, value], ...]} as JSON.
"""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator

acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
