"""``from amsp_ext.accelerate import Accelerator``: Accelerate with AMSP switched on in code.

See amsp_ext/integrations/accelerate.py. (The config route needs no import at all:
``accelerate launch --config_file configs/accelerate/amsp.yaml script.py``.)
"""

from amsp_ext.integrations.accelerate import Accelerator, amsp_deepspeed_config

__all__ = ["Accelerator", "amsp_deepspeed_config"]
