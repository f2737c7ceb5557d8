//! The offline `mutate` command, driven through its library function: exit codes, bad input
//! naming file and document, directories, stdin, every output format, and the examples.

use std::path::{Path, PathBuf};

mod mutate_support;

use mutate_support::{run, run_with_stdin};
use serde_json::{Value, json};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples")
}

fn example(name: &str) -> String {
    examples().join(name).display().to_string()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

const PRIVILEGED_POD: &str = "apiVersion: v1
kind: Pod
metadata:
  name: train
  namespace: ml
spec:
  containers:
    - name: trainer
      image: nvcr.io/nvidia/pytorch:24.05-py3
      env:
        - name: NVIDIA_VISIBLE_DEVICES
          value: \"0,1\"
      securityContext:
        privileged: true
";

#[test]
fn the_examples_directory_is_rewritten_and_explained() {
    let dir = examples().display().to_string();
    let r = run(&["-f", &dir]);
    assert_eq!(r.code, 0, "stderr:\n{}", r.stderr);
    // Every object comes out as YAML, rewritten where the policy rewrites it.
    let docs: Vec<Value> = serde_saphyr::from_multiple(&r.stdout).unwrap();
    assert_eq!(docs.len(), 8, "{}", r.stdout);
    let deployment = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let c = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert!(
        deployment["spec"]["template"]["metadata"]["annotations"]["gpuwarden.io/rewritten"]
            .is_string()
    );
    let daemonset = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    assert_eq!(
        daemonset["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privileged"],
        true
    );
    // And stderr says why, per object.
    for expected in [
        "Pod ml-research/llm-pretrain: REWRITTEN by GpuPolicy default@0 (Enforce)",
        "container trainer: privileged removed",
        "capabilities SYS_ADMIN dropped (not allowed)",
        "Deployment inference/vllm-llama3-70b: REWRITTEN",
        "requests nvidia.com/gpu=2 (NVIDIA_VISIBLE_DEVICES=0,1)",
        "device hostPath volume nvidia0,nvidiactl removed",
        "container node-metrics: privileged removed",
        "NVIDIA_VISIBLE_DEVICES=void",
        "requests nvidia.com/gpu=4 (annotation gpuwarden.io/gpu-count=4)",
        "DaemonSet gpu-operator/nvidia-dcgm-exporter: exempt, unchanged: every privileged or leaking GPU container has an image exempt in namespace gpu-operator",
        "Pod ml-research/jupyter-gpu: unchanged: no privileged or leaking GPU container",
        "Pod ml-research/dra-finetune: REWRITTEN",
        "container finetune: privileged removed; GPUs from its ResourceClaim gpu",
        "8 objects: 1 exempt, 1 passed through, 5 rewritten, 1 unchanged",
    ] {
        assert!(
            r.stderr.contains(expected),
            "missing {expected:?} in:\n{}",
            r.stderr
        );
    }
}

#[test]
fn diff_output_is_a_readable_unified_diff() {
    let r = run(&["-f", &example("02-deployment-two-gpus.yaml"), "-o", "diff"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout
            .starts_with("--- Deployment/inference/vllm-llama3-70b (original"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("+++ Deployment/inference/vllm-llama3-70b (rewritten)"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("@@ "), "{}", r.stdout);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with('-') && l.contains("privileged: true")),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with('+') && l.contains("privileged: false")),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with('+') && l.contains("nvidia.com/gpu")),
        "{}",
        r.stdout
    );
    // Unchanged objects produce no diff.
    let r = run(&["-f", &example("06-unprivileged-gpu-pod.yaml"), "-o", "diff"]);
    assert_eq!((r.code, r.stdout.as_str()), (0, ""));
}

#[test]
fn patch_and_json_outputs_apply_and_parse() {
    let r = run(&[
        "-f",
        &example("04-gpu-pod-privileged-sidecar.yaml"),
        "-o",
        "patch",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let patches: Vec<Value> = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(patches.len(), 1);
    assert_eq!(patches[0]["kind"], "Job");
    let patch: json_patch::Patch = serde_json::from_value(patches[0]["patch"].clone()).unwrap();
    let text = std::fs::read_to_string(example("04-gpu-pod-privileged-sidecar.yaml")).unwrap();
    let mut job: Value = serde_saphyr::from_str(&text).unwrap();
    json_patch::patch(&mut job, &patch.0).unwrap();
    assert_eq!(
        job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        "4"
    );
    assert!(
        patches[0]["patch"]
            .to_string()
            .contains("/spec/template/spec/containers/0")
    );

    let r = run(&[
        "-f",
        &example("04-gpu-pod-privileged-sidecar.yaml"),
        "-o",
        "json",
    ]);
    let out: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(out, job, "-o json is the patched object");

    // Several objects in JSON: a List.
    let r = run(&[
        "-f",
        &example("01-training-pod-visible-all.yaml"),
        "-f",
        &example("06-unprivileged-gpu-pod.yaml"),
        "-o",
        "json",
    ]);
    let out: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(out["kind"], "List");
    assert_eq!(out["items"].as_array().unwrap().len(), 2);
}

#[test]
fn exit_one_when_something_would_be_denied() {
    let dir = tempfile::tempdir().unwrap();
    let policy = write(
        dir.path(),
        "deny.yaml",
        "apiVersion: gpuwarden.io/v1alpha1
kind: GpuPolicy
metadata:
  name: deny-everywhere
spec:
  mode: Deny
",
    );
    let r = run(&[
        "-f",
        &example("01-training-pod-visible-all.yaml"),
        "--policy",
        &policy,
    ]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("DENIED by GpuPolicy deny-everywhere@0"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("gpuwarden-webhook mutate -f"),
        "{}",
        r.stderr
    );

    // maxPerContainer in Enforce: denied too.
    let r = run_with_stdin(
        &["-f", "-"],
        &PRIVILEGED_POD.replace("\"0,1\"", "\"0,1,2,3,4,5,6,7,8,9\""),
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("more than maxPerContainer 8"),
        "{}",
        r.stderr
    );
}

#[test]
fn policy_selection_uses_namespace_and_namespace_labels() {
    let dir = tempfile::tempdir().unwrap();
    let policies = write(
        dir.path(),
        "policies.yaml",
        "apiVersion: gpuwarden.io/v1alpha1
kind: GpuPolicy
metadata:
  name: prod-deny
spec:
  priority: 10
  mode: Deny
  namespaceSelector:
    matchLabels:
      env: prod
---
apiVersion: gpuwarden.io/v1alpha1
kind: GpuPolicy
metadata:
  name: audit-rest
spec:
  mode: Audit
",
    );
    let pod_without_ns = PRIVILEGED_POD.replace("  namespace: ml\n", "");
    let r = run_with_stdin(
        &["-f", "-", "--policy", &policies, "--namespace", "team-a"],
        &pod_without_ns,
    );
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("Pod team-a/train: admitted unchanged by GpuPolicy audit-rest@0 (Audit)"),
        "{}",
        r.stderr
    );
    let r = run_with_stdin(
        &[
            "-f",
            "-",
            "--policy",
            &policies,
            "--namespace-labels",
            "env=prod,team=a",
        ],
        &pod_without_ns,
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("Pod default/train: DENIED by GpuPolicy prod-deny@0"),
        "{}",
        r.stderr
    );
    // A Namespace object in the input supplies its labels.
    let with_ns = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ml\n  labels:\n    env: prod\n---\n{PRIVILEGED_POD}"
    );
    let r = run_with_stdin(&["-f", "-", "--policy", &policies], &with_ns);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("Namespace default/ml: no pod template, passed through unchanged"),
        "{}",
        r.stderr
    );
}

#[test]
fn bad_input_exits_two_naming_file_document_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.yaml").display().to_string();
    let r = run(&["-f", &missing]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains(&format!("{missing}: failed to read")),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty());

    let bad = write(
        dir.path(),
        "bad.yaml",
        &format!("{PRIVILEGED_POD}---\napiVersion: v1\nkind: Pod\nmetadata: {{name: [broken\n"),
    );
    let r = run(&["-f", &bad]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains(&format!("{bad}: document 2 (line 15): invalid YAML")),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty(), "no output on bad input");

    // A NIMService its operator could not render a pod from: the field is named.
    let nim = write(
        dir.path(),
        "nim.yaml",
        "apiVersion: apps.nvidia.com/v1alpha1\nkind: NIMService\nmetadata: {name: llm}\nspec:\n  image: {tag: \"1.8\"}\n",
    );
    let r = run(&["-f", &nim]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!(
            "{nim}: document 1 (line 1): NIMService llm: spec.image.repository: missing"
        )),
        "{}",
        r.stderr
    );
    assert!(r.stdout.is_empty(), "no output on bad input");

    let scalar = write(dir.path(), "scalar.yaml", "just text\n");
    let r = run(&["-f", &scalar]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .contains("document 1 (line 1): not a Kubernetes object"),
        "{}",
        r.stderr
    );

    let json = write(dir.path(), "bad.json", "{\"kind\": \"Pod\",");
    let r = run(&["-f", &json]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains(&format!("{json}: invalid JSON")),
        "{}",
        r.stderr
    );

    let no_template = write(
        dir.path(),
        "deploy.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: d\nspec: {}\n",
    );
    let r = run(&["-f", &no_template]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr
            .contains("Deployment d has no pod template at /spec/template"),
        "{}",
        r.stderr
    );

    let not_policy = write(
        dir.path(),
        "policy.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n",
    );
    let r = run(&[
        "-f",
        &example("06-unprivileged-gpu-pod.yaml"),
        "--policy",
        &not_policy,
    ]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("expected a GpuPolicy, found ConfigMap"),
        "{}",
        r.stderr
    );

    let r = run(&[
        "-f",
        &example("06-unprivileged-gpu-pod.yaml"),
        "--namespace-labels",
        "novalue",
    ]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("--namespace-labels"), "{}", r.stderr);

    let empty = tempfile::tempdir().unwrap();
    let r = run(&["-f", &empty.path().display().to_string()]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("no manifests found"), "{}", r.stderr);
}

#[test]
fn directories_are_read_in_name_order_and_other_kinds_pass_through() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), "b-pod.yml", PRIVILEGED_POD);
    write(
        dir.path(),
        "a-config.json",
        r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"cfg"},"data":{"x":"1"}}"#,
    );
    write(
        dir.path(),
        "c-cron.yaml",
        "apiVersion: batch/v1
kind: CronJob
metadata:
  name: nightly
spec:
  schedule: \"0 3 * * *\"
  jobTemplate:
    spec:
      template:
        spec:
          restartPolicy: Never
          containers:
            - name: eval
              image: nvcr.io/nvidia/pytorch:24.05-py3
              securityContext:
                privileged: true
              resources:
                limits:
                  nvidia.com/gpu: 1
",
    );
    write(dir.path(), "notes.txt", "not a manifest");
    write(dir.path(), "d-gpus.fake.yaml", "gpus:\n  - index: 0\n");
    let r = run(&["-f", &dir.path().display().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("d-gpus.fake.yaml: skipped: not a Kubernetes manifest"),
        "{}",
        r.stderr
    );
    let docs: Vec<Value> = serde_saphyr::from_multiple(&r.stdout).unwrap();
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ConfigMap", "Pod", "CronJob"]);
    assert_eq!(docs[0]["data"]["x"], "1", "other kinds untouched");
    let cron = &docs[2]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(cron["securityContext"]["privileged"], false);
    assert_eq!(
        cron["resources"]["limits"]["nvidia.com/gpu"], 1,
        "the existing limit is kept"
    );
}

/// An invalid policy fails closed: `mutate --policy` exits 2 naming the file, the policy and
/// the field, rather than skipping it and admitting everything ("no GpuPolicy selects ...").
#[test]
fn an_invalid_policy_is_refused_not_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let policy = |name: &str, spec: &str| {
        format!(
            "apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata:\n  name: {name}\nspec:\n{spec}"
        )
    };
    for (case, spec, expected) in [
        (
            "selector",
            "  namespaceSelector:\n    matchExpressions:\n      - {key: team, operator: Sideways, values: [a]}\n",
            "InvalidSelector: spec.namespaceSelector",
        ),
        (
            "counts",
            "  gpu:\n    defaultCount: 9\n    maxPerContainer: 8\n",
            "InvalidCount: spec.gpu.defaultCount 9 is more than spec.gpu.maxPerContainer 8",
        ),
        (
            "capability",
            "  capabilities:\n    allowed: [IPC_LOCK, NOT_A_CAP]\n",
            "UnknownCapability: spec.capabilities.allowed: unknown Linux capabilities NOT_A_CAP",
        ),
        (
            "class",
            "  gpu:\n    requestAs: ResourceClaim\n    deviceClassName: GPU_Class\n",
            "InvalidDeviceClass: spec.gpu.deviceClassName \"GPU_Class\" is not a DNS subdomain",
        ),
    ] {
        let file = write(
            dir.path(),
            &format!("{case}.yaml"),
            &policy(&format!("bad-{case}"), spec),
        );
        let r = run(&[
            "-f",
            &example("01-training-pod-visible-all.yaml"),
            "--policy",
            &file,
        ]);
        assert_eq!(r.code, 2, "{case}: {}", r.stderr);
        assert!(
            r.stderr.contains(&format!("{file} document 1 (line 1)"))
                && r.stderr
                    .contains(&format!("GpuPolicy bad-{case}: {expected}")),
            "{case}: {}",
            r.stderr
        );
        assert!(r.stdout.is_empty(), "{case}: nothing is written");
    }
}

#[test]
fn claims_in_the_manifest_judge_its_pods_and_the_claim_mode_names_templates() {
    let dir = tempfile::tempdir().unwrap();
    let claims = "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: ml}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly: {deviceClassName: gpu.nvidia.com}
---
apiVersion: v1
kind: Pod
metadata: {name: dra, namespace: ml}
spec:
  resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]
  containers:
    - name: trainer
      image: nvcr.io/nvidia/pytorch:24.05-py3
      securityContext: {privileged: true}
      resources: {claims: [{name: gpu}]}
";
    let file = write(dir.path(), "dra.yaml", claims);
    let r = run(&["-f", &file, "-o", "json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out: Value = serde_json::from_str(&r.stdout).unwrap();
    let pod = &out["items"][1];
    let trainer = &pod["spec"]["containers"][0];
    assert_eq!(trainer["securityContext"]["privileged"], false);
    assert_eq!(
        trainer["resources"]["limits"],
        Value::Null,
        "the claim holds its GPU"
    );
    assert!(
        r.stderr.contains("GPUs from its ResourceClaim gpu"),
        "{}",
        r.stderr
    );

    // A policy that requests GPUs as claims: gpuwarden's templates are taken to exist.
    let policy = write(
        dir.path(),
        "policy.yaml",
        "apiVersion: gpuwarden.io/v1alpha1\nkind: GpuPolicy\nmetadata: {name: dra}\nspec:\n  gpu: {requestAs: ResourceClaim}\n",
    );
    let r = run(&[
        "-f",
        &example("02-deployment-two-gpus.yaml"),
        "--policy",
        &policy,
        "-o",
        "json",
    ]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let out: Value = serde_json::from_str(&r.stdout).unwrap();
    let spec = &out["spec"]["template"]["spec"];
    assert_eq!(
        spec["resourceClaims"],
        serde_json::json!([{"name": "gpuwarden-gpus-0", "resourceClaimTemplateName": "gpuwarden-gpu.nvidia.com-2"}]),
        "{}",
        r.stderr
    );

    // A claim document that is not one is bad input.
    let bad = write(
        dir.path(),
        "bad.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: x, namespace: ml}\nspec:\n  devices: {requests: oops}\n",
    );
    let r = run(&["-f", &bad]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains(&format!(
            "{bad}: document 1 (line 1): ResourceClaim x: spec is not a claim spec"
        )),
        "{}",
        r.stderr
    );
}

/// A Volcano Job with a privileged worker task that names GPUs, and a PyTorchJob whose
/// master is exempt by nothing and whose worker is ordinary: the pods inside them are judged
/// where they stand.
const CUSTOM_RESOURCES: &str = "apiVersion: batch.volcano.sh/v1alpha1
kind: Job
metadata:
  name: train
  namespace: ml
spec:
  minAvailable: 2
  tasks:
    - name: ps
      replicas: 1
      template:
        spec:
          containers:
            - name: ps
              image: registry.example.com/ps:1
    - name: worker
      replicas: 2
      template:
        metadata:
          labels: {role: worker}
        spec:
          containers:
            - name: worker
              image: nvcr.io/nvidia/pytorch:24.05-py3
              env:
                - {name: NVIDIA_VISIBLE_DEVICES, value: \"0,1\"}
              securityContext: {privileged: true}
---
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: rc
  namespace: ml
spec:
  headGroupSpec:
    template:
      spec:
        containers:
          - {name: head, image: rayproject/ray:2.9.0}
  workerGroupSpecs:
    - groupName: gpu
      template:
        spec:
          containers:
            - name: worker
              image: rayproject/ray:2.9.0-gpu
              resources: {limits: {nvidia.com/gpu: 1}}
              securityContext: {privileged: true}
              volumeMounts: [{name: ib, mountPath: /dev/infiniband}]
          volumes: [{name: ib, hostPath: {path: /dev/infiniband}}]
---
apiVersion: apps.nvidia.com/v1alpha1
kind: NIMService
metadata:
  name: llm
  namespace: ml
spec:
  image: {repository: nvcr.io/nim/meta/llama3-8b-instruct, tag: 1.0.0}
  resources: {limits: {nvidia.com/gpu: 1}}
";

#[test]
fn pods_inside_custom_resources_are_judged_where_they_stand() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "crs.yaml", CUSTOM_RESOURCES);
    let r = run(&["-f", &path]);
    // The RayCluster's worker would lose privilege while it mounts /dev/infiniband.
    assert_eq!(r.code, 1, "stderr:\n{}", r.stderr);
    let lines: Vec<&str> = r.stderr.lines().collect();
    let line = |prefix: &str| {
        (lines.iter())
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?} in\n{}", r.stderr))
    };
    // Containers that hold no GPU get NVIDIA_VISIBLE_DEVICES=void, as the API server's
    // policy sets it in a cluster.
    assert!(line("  Job ml/train spec.tasks[0].template: ").contains("VOIDED"));
    assert!(line("  Job ml/train spec.tasks[1].template: ").contains("REWRITTEN"));
    assert!(line("  RayCluster ml/rc spec.headGroupSpec.template: ").contains("VOIDED"));
    assert!(line("  RayCluster ml/rc spec.workerGroupSpecs[0].template: ").contains("DENIED"));
    assert!(
        r.stderr.contains(
            "an unprivileged container cannot open RDMA devices (/dev/infiniband, volume ib)"
        ) && r.stderr.contains("rdma/rdma_shared_device_a"),
        "{}",
        r.stderr
    );
    // A NIMService is judged as the pod its operator renders.
    assert!(
        line("  NIMService ml/llm (the pod its NIM operator renders): ")
            .contains("unchanged: no privileged or leaking GPU container"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("3 objects: 1 denied, 1 rewritten, 1 unchanged, 2 voided"),
        "{}",
        r.stderr
    );

    // The rewrite is made where the template stands, and the patch says where.
    let docs: Vec<Value> = serde_saphyr::from_multiple(&r.stdout).unwrap();
    let worker = &docs[0]["spec"]["tasks"][1]["template"];
    let c = &worker["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"], false);
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "2");
    assert!(worker["metadata"]["annotations"]["gpuwarden.io/rewritten"].is_string());
    let launcher = &docs[0]["spec"]["tasks"][0]["template"]["spec"]["containers"][0];
    assert_eq!(
        launcher["env"],
        json!([{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}])
    );
    let r = run(&["-f", &path, "-o", "patch"]);
    let patches: Value = serde_json::from_str(&r.stdout).unwrap();
    let ops = patches[0]["patch"].as_array().unwrap();
    assert!(
        ops.iter().all(|op| {
            let path = op["path"].as_str().unwrap();
            path.starts_with("/spec/tasks/1/template/")
                || path == "/spec/tasks/0/template/spec/containers/0/env"
        }),
        "{ops:?}"
    );
}

#[test]
fn objects_left_alone_come_out_as_kubectl_reads_them() {
    // The GPU Operator's driver DaemonSet writes `defaultMode: 0755` (YAML 1.1 octal: 493)
    // and is exempt in its namespace.
    let text = "apiVersion: apps/v1
kind: DaemonSet
metadata: {name: nvidia-driver-daemonset, namespace: gpu-operator}
spec:
  selector: {matchLabels: {app: d}}
  template:
    metadata: {labels: {app: d}}
    spec:
      containers:
        - name: nvidia-driver-ctr
          image: nvcr.io/nvidia/driver:595.91.07-ubuntu24.04
          securityContext: {privileged: true}
          env: [{name: ON, value: \"on\"}, {name: QUOTED, value: \"0o644\"}]
          volumeMounts: [{name: run, mountPath: /run/nvidia}]
          resources: {limits: {memory: 1e3}}
      volumes:
        - name: scripts
          configMap: {name: s, defaultMode: 0755}
        - {name: run, hostPath: {path: /run/nvidia}}
      hostPID: yes
";
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "driver.yaml", text);
    let r = run(&["-f", &path, "-o", "json"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("exempt, unchanged"), "{}", r.stderr);
    let ds: Value = serde_json::from_str(&r.stdout).unwrap();
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(
        spec["volumes"][0]["configMap"]["defaultMode"].to_string(),
        "493"
    );
    assert_eq!(spec["hostPID"], true);
    assert_eq!(
        spec["containers"][0]["resources"]["limits"]["memory"].to_string(),
        "1000"
    );
    assert_eq!(spec["containers"][0]["env"][0]["value"], "on");
    // YAML output keeps strings that YAML 1.1 would read otherwise quoted.
    let r = run(&["-f", &path]);
    let again: Value = gpuwarden_webhook::manifest::yaml_value(&r.stdout).unwrap();
    assert_eq!(again, ds, "{}", r.stdout);
}

/// The pre-flight lists ConfigMaps and Secrets whose keys spell an NVIDIA runtime variable,
/// as `kubectl get configmaps,secrets` with keys only prints them (docs/preflight.md,
/// "Before you install"), and never their values; exempt namespaces and allowed features pass.
#[test]
fn config_maps_and_secrets_with_runtime_variable_keys_are_listed() {
    let keys_only = "apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: gpu-env, namespace: team}
  data: {\"NVIDIA_VISIBLE_DEVICES\": \"\", \"NVIDIA_GDRCOPY\": \"\", \"APP\": \"\"}
- apiVersion: v1
  kind: Secret
  metadata: {name: imex, namespace: team}
  data: {\"NVIDIA_IMEX_CHANNELS\": \"\"}
- apiVersion: v1
  kind: Secret
  metadata: {name: hf-token, namespace: team}
  data: {\"HF_TOKEN\": \"\"}
- apiVersion: v1
  kind: ConfigMap
  metadata: {name: node-env, namespace: kube-system}
  data: {\"NVIDIA_VISIBLE_DEVICES\": \"\"}
";
    let r = run_with_stdin(&["-f", "-", "-o", "diff"], keys_only);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("ConfigMap team/gpu-env: RUNTIME VARIABLE KEYS NVIDIA_VISIBLE_DEVICES:"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("Secret team/imex: RUNTIME VARIABLE KEYS NVIDIA_IMEX_CHANNELS:"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("Secret team/hf-token: no pod template"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("ConfigMap kube-system/node-env: no pod template"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("2 runtime variable keys"), "{}", r.stderr);
}

/// `-o policyreport`: one PolicyReport per namespace with a finding, each result naming the
/// object, the container, the rule and the message the webhook gives; namespaces with
/// nothing to report (here: exempt) get none; a denial is a result too.
#[test]
fn policyreport_output_lists_each_finding_per_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let plain = "apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: kube-system
spec:
  containers:
    - name: web
      image: nginx:1.27
";
    let over = "apiVersion: v1
kind: Pod
metadata:
  name: greedy
  namespace: research
  annotations:
    gpuwarden.io/gpu-count: \"64\"
spec:
  containers:
    - name: trainer
      image: nvcr.io/nvidia/pytorch:24.05-py3
      securityContext:
        privileged: true
";
    let text = format!("{PRIVILEGED_POD}---\n{plain}---\n{over}");
    let file = write(dir.path(), "pods.yaml", &text);
    let r = run(&["-f", &file, "-o", "policyreport"]);
    assert_eq!(
        r.code, 1,
        "the greedy pod would be denied; stderr:\n{}",
        r.stderr
    );
    let docs: Vec<Value> = serde_saphyr::from_multiple(&r.stdout).unwrap();
    let namespaces: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["namespace"].as_str().unwrap())
        .collect();
    assert_eq!(namespaces, ["ml", "research"], "{}", r.stdout);
    for d in &docs {
        assert_eq!(d["apiVersion"], "wgpolicyk8s.io/v1alpha2");
        assert_eq!(d["kind"], "PolicyReport");
        assert_eq!(d["metadata"]["name"], "gpuwarden");
    }
    let ml = &docs[0];
    let results = ml["results"].as_array().unwrap();
    let privileged = results
        .iter()
        .find(|r| r["rule"] == "privileged-gpu")
        .expect("privileged-gpu result");
    assert_eq!(privileged["policy"], "default");
    assert_eq!(privileged["source"], "gpuwarden");
    assert_eq!(privileged["result"], "fail");
    assert_eq!(privileged["properties"]["container"], "trainer");
    assert_eq!(privileged["properties"]["verdict"], "rewritten");
    assert_eq!(privileged["resources"][0]["kind"], "Pod");
    assert_eq!(privileged["resources"][0]["name"], "train");
    assert!(
        privileged["message"]
            .as_str()
            .unwrap()
            .starts_with("container trainer: privileged removed"),
        "{privileged:#?}"
    );
    assert!(
        r.stderr.contains(privileged["message"].as_str().unwrap()),
        "the message is the webhook's own: {}",
        r.stderr
    );
    assert_eq!(ml["summary"]["fail"], results.len());
    let research = &docs[1]["results"].as_array().unwrap();
    let denied = research
        .iter()
        .find(|r| r["rule"] == "denied")
        .expect("denied result");
    assert_eq!(denied["properties"]["verdict"], "denied");
    assert!(
        denied["message"].as_str().unwrap().contains("64"),
        "{denied:#?}"
    );
}
