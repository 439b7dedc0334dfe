"""Kernels: how attention runs on a device. The selector picks one per platform and call."""

from eqx_bsattn.contract import (
    AbstractKernel as AbstractKernel,
    AbstractLseKernel as AbstractLseKernel,
    Features as Features,
)

from .reference import DenseReference as DenseReference, reference_attention as reference_attention
from .cudnn import CudnnDense as CudnnDense, cudnn_mask_options as cudnn_mask_options
from .xla import XlaBlockSparse as XlaBlockSparse
from .triton import TritonBlockSparse as TritonBlockSparse
from .splash import SplashBlockSparse as SplashBlockSparse
from .mosaic import MosaicBlockSparse as MosaicBlockSparse
