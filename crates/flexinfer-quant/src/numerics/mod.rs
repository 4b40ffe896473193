//! The GPTQ maths, bottom-up: the min/max grid, the dense linear-algebra steps, Hessian preparation
//! and recovery, the column sweep and RTN, and the checkpoint's bit packing. Nothing here reads files.

pub mod gptq;
pub mod hessian;
pub mod linalg;
pub mod pack;
pub mod quantizer;
