"""The U-Net of the rematerialization benchmark is the built-in example ``unet-small``."""

from trainledger.examples import UNet, unet_small

__all__ = ["UNet", "unet_small"]
