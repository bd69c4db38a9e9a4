"""gpucoll: GPU-first collectives for Python without PyTorch.

torch.distributed's vocabulary (stores, process groups, async Work, object
collectives) over NCCL through CuPy on GPUs and a NumPy backend on CPUs.
``import gpucoll`` never imports CuPy; the NCCL backend loads it when a group
needs it.

The public surface is exactly what this module re-exports (see ``__all__``).
"""

from __future__ import annotations

from .errors import BackendUnavailableError as BackendUnavailableError
from .errors import DistBackendError as DistBackendError
from .errors import DistError as DistError
from .errors import DistNetworkError as DistNetworkError
from .errors import DistStoreError as DistStoreError
from .errors import DistStoreTimeoutError as DistStoreTimeoutError
from .errors import QueueEmptyError as QueueEmptyError
from ._reduce_op import ReduceOp as ReduceOp
from ._reduce_op import make_premul_sum as make_premul_sum
from ._reduce_op import make_premul_sum as _make_nccl_premul_sum  # torch's (private) name
from ._work import Work as Work
from ._work import WorkInfo as WorkInfo

# --- stores (store/) ---
from .store import FileStore as FileStore
from .store import HashStore as HashStore
from .store import PrefixStore as PrefixStore
from .store import Store as Store
from .store import TCPStore as TCPStore

# --- process groups, collectives, object collectives (world API) ---
from . import functional as functional
from ._collectives import CoalescingManager as CoalescingManager
from ._group.options import CPUOptions as CPUOptions
from ._group.options import FakeOptions as FakeOptions
from ._group.options import FakeProcessGroup as FakeProcessGroup
from ._group.options import NCCLOptions as NCCLOptions
from ._collectives import P2POp as P2POp
from ._collectives import all_gather as all_gather
from ._collectives import all_gather_coalesced as all_gather_coalesced
from ._collectives import all_gather_into_tensor as all_gather_into_tensor
from ._collectives import all_gather_single as all_gather_single
from ._collectives import all_reduce as all_reduce
from ._collectives import all_reduce_coalesced as all_reduce_coalesced
from ._collectives import all_to_all as all_to_all
from ._collectives import all_to_all_single as all_to_all_single
from ._collectives import barrier as barrier
from ._collectives import batch_isend_irecv as batch_isend_irecv
from ._collectives import broadcast as broadcast
from ._collectives import coalescing as coalescing
from ._collectives import gather as gather
from ._collectives import irecv as irecv
from ._collectives import isend as isend
from ._collectives import monitored_barrier as monitored_barrier
from ._collectives import recv as recv
from ._collectives import reduce as reduce
from ._collectives import reduce_scatter as reduce_scatter
from ._collectives import reduce_scatter_single as reduce_scatter_single
from ._collectives import reduce_scatter_tensor as reduce_scatter_tensor
from ._collectives import scatter as scatter
from ._collectives import send as send
from ._group import GroupMember as GroupMember
from ._group.member import group as group
from ._group import ProcessGroup as ProcessGroup
from ._objects import all_gather_bytes as all_gather_bytes
from ._objects import all_gather_object as all_gather_object
from ._objects import broadcast_bytes as broadcast_bytes
from ._objects import broadcast_object_list as broadcast_object_list
from ._objects import gather_bytes as gather_bytes
from ._objects import gather_object as gather_object
from ._objects import recv_bytes as recv_bytes
from ._objects import recv_object_list as recv_object_list
from ._objects import scatter_bytes as scatter_bytes
from ._objects import scatter_object_list as scatter_object_list
from ._objects import send_bytes as send_bytes
from ._objects import send_object_list as send_object_list
from ._group import Backend as Backend
from ._world import destroy_process_group as destroy_process_group
from ._world import get_backend as get_backend
from ._world import get_global_rank as get_global_rank
from ._world import get_group_rank as get_group_rank
from ._world import get_process_group_ranks as get_process_group_ranks
from ._world import get_rank as get_rank
from ._world import get_world_size as get_world_size
from ._world import init_process_group as init_process_group
from ._world import is_available as is_available
from ._world import is_initialized as is_initialized
from ._world import is_nccl_available as is_nccl_available
from ._new_groups import new_group as new_group
from ._new_groups import new_subgroups as new_subgroups
from ._new_groups import new_subgroups_by_enumeration as new_subgroups_by_enumeration
from ._new_groups import split_group as split_group

reduce_op = ReduceOp
"""torch's legacy spelling (``dist.reduce_op.SUM``): the same class as :class:`ReduceOp`."""

# --- c10d extras: store collectives, device mesh, debug levels ---
from .store._collectives import StoreCollectives as StoreCollectives
from ._device_mesh import DeviceMesh as DeviceMesh
from ._device_mesh import init_device_mesh as init_device_mesh
from ._debug import DebugLevel as DebugLevel
from ._debug import get_debug_level as get_debug_level
from ._debug import set_debug_level as set_debug_level
from ._debug import set_debug_level_from_env as set_debug_level_from_env
from ._rendezvous import rendezvous_iterator as rendezvous

# --- surviving rank failures (docs/fault-tolerance.md) ---
from ._fault.api import grow_group as grow_group
from ._fault.api import join_process_group as join_process_group
from ._fault.api import shrink_group as shrink_group

# --- data parallel: gradient buckets and communication hooks (docs/data-parallel.md) ---
from .errors import ParameterMismatchError as ParameterMismatchError
from ._ddp.buckets import compute_bucket_assignment_by_size as compute_bucket_assignment_by_size
from ._ddp.grad_bucket import GradBucket as GradBucket
from ._ddp.reducer import Reducer as Reducer
from ._ddp.helpers import broadcast_coalesced as broadcast_coalesced
from ._ddp.helpers import verify_params_across_processes as verify_params_across_processes
from ._ddp.jit import bucketed_all_reduce as bucketed_all_reduce
from . import ddp_comm_hooks as ddp_comm_hooks

# --- NCCL memory: the allocator's pool and buffer registration (docs/nccl-backend.md) ---
from ._backends.nccl.mempool import NcclMemPool as NcclMemPool
from ._backends.nccl.mempool import nccl_mem_pool as nccl_mem_pool
from ._group.registration import BufferRegistration as BufferRegistration
from .errors import RegistrationError as RegistrationError

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "DistBackendError", "DistError", "DistNetworkError",
    "DistStoreError", "DistStoreTimeoutError", "QueueEmptyError",
    "ReduceOp", "reduce_op", "make_premul_sum", "Work", "WorkInfo",
    # stores
    "Store", "HashStore", "FileStore", "TCPStore", "PrefixStore",
    # world API
    "init_process_group", "destroy_process_group", "is_initialized", "is_available", "is_nccl_available",
    "get_rank", "get_world_size", "get_backend", "get_process_group_ranks", "get_group_rank",
    "get_global_rank", "new_group", "split_group", "new_subgroups", "new_subgroups_by_enumeration",
    "ProcessGroup", "GroupMember", "group", "Backend", "NCCLOptions", "CPUOptions", "FakeOptions", "FakeProcessGroup",
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv", "barrier", "monitored_barrier",
    "coalescing", "CoalescingManager",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
    "send_object_list", "recv_object_list", "all_gather_bytes", "gather_bytes", "broadcast_bytes",
    "scatter_bytes", "send_bytes", "recv_bytes",
    "functional",
    # c10d extras
    "StoreCollectives", "DeviceMesh", "init_device_mesh", "rendezvous",
    "DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env",
    # fault tolerance
    "shrink_group", "grow_group", "join_process_group",
    # data parallel
    "ParameterMismatchError", "compute_bucket_assignment_by_size", "GradBucket", "Reducer",
    "broadcast_coalesced", "verify_params_across_processes", "bucketed_all_reduce", "ddp_comm_hooks",
    # NCCL memory
    "nccl_mem_pool", "NcclMemPool", "BufferRegistration", "RegistrationError",
]
