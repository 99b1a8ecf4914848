//! nvstore: node, client, cluster map and the command-line interface.

pub mod admin;
pub mod bench;
pub mod cli;
pub mod device;
pub mod error;
pub mod map;
pub mod placement;
pub mod storebench;
pub mod storecli;
pub mod wire;

pub use client::Client;
pub use error::{Error, Result};
pub mod bench_cluster;
pub mod bench_hot;
pub mod bench_recovery;
pub mod client;
pub mod client_ec;
pub mod cluster_cmd;
pub mod config;
pub mod demo;
pub mod monclient;
pub mod monitor;
pub mod netns;
pub mod node;
pub mod ops;
pub mod optrack;
pub mod peers;
pub mod prom;
pub mod queue;
pub mod scrub_cmd;
