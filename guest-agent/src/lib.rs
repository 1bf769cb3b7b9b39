//! The guest agent: PID 1 in Linux guests, serving exec and files over vsock (in progress).
