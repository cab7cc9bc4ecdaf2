"""torchplug-torchft: ``ft-ddp``, data parallel over replica groups that outlive each other.

Each replica group (one or more ranks, its own ``torchrun``) trains a full replica; a torchft
``Manager`` per group meets the others at a lighthouse once per step, averages the gradients of
the groups alive at that step, and commits the step only when the quorum agrees. A group that
dies is restarted by its own launcher and takes the model, optimizer, loader position and the
rest of ``engine.resume``'s state live from a healthy peer, while the others keep stepping.
``torchplug launch --strategy ft-ddp --replicas R -n N train.py`` starts the lighthouse and the
groups on one machine (docs/fault-tolerance.md in torchplug has the rules and a SLURM recipe).
"""

__version__ = "0.1.0"
