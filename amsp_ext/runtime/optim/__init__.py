"""The optimizer over this rank's owned fp32 masters (optimizer.py), inter-tensor ownership
(ownership.py), the local tensor layout (layout.py), the non-finite guard and fp16 loss scaling."""
