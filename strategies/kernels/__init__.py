"""Kernels: how attention runs on a device. The selector picks one per platform and call; each
kernel that tiles has its own config (`TritonConfig`, `XlaConfig`, `SplashConfig`,
`MosaicConfig`, `PallasTpuConfig`)."""

from eqx_bsattn.contract import (
    AbstractKernel as AbstractKernel,
    AbstractLseKernel as AbstractLseKernel,
    Features as Features,
)

from .reference import DenseReference as DenseReference, reference_attention as reference_attention
from .cudnn import CudnnDense as CudnnDense, cudnn_mask_options as cudnn_mask_options
from .xla import XlaBlockSparse as XlaBlockSparse, XlaConfig as XlaConfig
from .triton import TritonBlockSparse as TritonBlockSparse, TritonConfig as TritonConfig
from .splash import SplashBlockSparse as SplashBlockSparse, SplashConfig as SplashConfig
from .mosaic import MosaicBlockSparse as MosaicBlockSparse, MosaicConfig as MosaicConfig
from .pallas_tpu import PallasTpuBlockSparse as PallasTpuBlockSparse, PallasTpuConfig as PallasTpuConfig
