//! nvstore: node, client, cluster map and the command-line interface.

pub mod bench;
pub mod cli;
pub mod device;
pub mod storebench;
pub mod storecli;
