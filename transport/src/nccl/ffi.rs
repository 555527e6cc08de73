//! The part of NCCL's C ABI this module calls, declared here because the library is loaded at
//! run time (no `nccl.h` at build time). Values are those of NCCL 2.x's `nccl.h`.

use std::ffi::{c_char, c_int, c_void};

/// `ncclResult_t`: a C enum, passed as `int`.
pub(crate) type NcclResult = c_int;
/// `ncclSuccess`.
pub(crate) const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: an operation of a non-blocking communicator is still running (not an
/// error).
pub(crate) const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclDataType_t` (a C enum, `int`). `ncclInt8` and `ncclChar` are 0; bytes travel as
/// `ncclUint8`, so counts are byte counts.
pub(crate) type NcclDataType = c_int;
pub(crate) const NCCL_UINT8: NcclDataType = 1;

/// `ncclComm_t`: pointer to an opaque `struct ncclComm`.
pub(crate) type NcclComm = *mut c_void;

/// `cudaStream_t`: the runtime's stream handle is the driver's `CUstream`.
pub(crate) type CudaStream = cudarc::driver::sys::CUstream;

/// Bytes in an `ncclUniqueId`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: `struct { char internal[128]; }`, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawUniqueId {
    pub internal: [u8; UNIQUE_ID_BYTES],
}

pub(crate) type GetVersionFn = unsafe extern "C" fn(version: *mut c_int) -> NcclResult;
pub(crate) type GetUniqueIdFn = unsafe extern "C" fn(id: *mut RawUniqueId) -> NcclResult;
pub(crate) type CommInitRankFn =
    unsafe extern "C" fn(comm: *mut NcclComm, nranks: c_int, id: RawUniqueId, rank: c_int) -> NcclResult;
pub(crate) type CommFn = unsafe extern "C" fn(comm: NcclComm) -> NcclResult;
pub(crate) type CommGetAsyncErrorFn =
    unsafe extern "C" fn(comm: NcclComm, err: *mut NcclResult) -> NcclResult;
pub(crate) type GetErrorStringFn = unsafe extern "C" fn(result: NcclResult) -> *const c_char;
pub(crate) type GroupFn = unsafe extern "C" fn() -> NcclResult;
pub(crate) type SendFn = unsafe extern "C" fn(
    buf: *const c_void,
    count: usize,
    dtype: NcclDataType,
    peer: c_int,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;
pub(crate) type RecvFn = unsafe extern "C" fn(
    buf: *mut c_void,
    count: usize,
    dtype: NcclDataType,
    peer: c_int,
    comm: NcclComm,
    stream: CudaStream,
) -> NcclResult;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_has_the_c_layout() {
        assert_eq!(std::mem::size_of::<RawUniqueId>(), 128);
        assert_eq!(std::mem::align_of::<RawUniqueId>(), 1);
    }
}
