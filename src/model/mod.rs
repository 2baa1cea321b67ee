//! Models: Llama-family and GPT-2 shapes as lists of units, and (with the model issue)
//! their blocks in tch and Hugging Face weight I/O.

pub mod config;
