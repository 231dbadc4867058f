//! facenet-pytorch's own MTCNN as the reference the face tests hold the gateway to
//! (`scripts/mtcnn_reference.py`, run in the venv `scripts/setup` makes).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use crate::repo_root;

/// One face as facenet-pytorch reports it.
#[derive(Debug, Clone)]
pub struct RefFace {
    pub bbox: [f64; 4],
    pub landmarks: [[f64; 2]; 5],
}

/// facenet-pytorch's faces for each file (by base name), with `args` for its MTCNN.
pub fn reference(files: &[PathBuf], args: &[&str]) -> BTreeMap<String, Vec<RefFace>> {
    let root = repo_root();
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("scripts/mtcnn_reference.py"))
        .args(args)
        .args(files)
        .output()
        .expect("running scripts/mtcnn_reference.py");
    assert!(out.status.success(), "mtcnn_reference.py failed: {}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("reference prints json");
    let num = |v: &serde_json::Value| v.as_f64().expect("a number");
    json.as_object()
        .expect("an object")
        .iter()
        .map(|(name, image)| {
            let faces = image["faces"]
                .as_array()
                .expect("faces")
                .iter()
                .map(|f| RefFace {
                    bbox: [0, 1, 2, 3].map(|k| num(&f["box"][k])),
                    landmarks: [0, 1, 2, 3, 4].map(|k| [num(&f["landmarks"][k][0]), num(&f["landmarks"][k][1])]),
                })
                .collect();
            (name.clone(), faces)
        })
        .collect()
}

pub fn iou(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let area = |r: &[f64; 4]| (r[2] - r[0]) * (r[3] - r[1]);
    w * h / (area(a) + area(b) - w * h)
}

