"""Imported last by dist_harness's forkserver, after its preloads: freezes the objects they made.

Python's advice for a process that forks without exec (``gc.freeze``): the children's collections
skip those objects, and so does ``gc.get_objects()``, which fleet scans for the modules holding an
optimizer's parameters (fleet.training.owners) every time a test wraps an optimizer, about 0.1 s a
scan over torch's 300,000 import-time objects. None of them is a model: models are made in the child.
"""

import gc

gc.freeze()
