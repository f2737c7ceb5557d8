{{/*
The image every container runs: repository[:tag][@digest], the tag defaulting to the
chart's appVersion.
*/}}
{{- define "gpuwarden.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- .Values.image.repository -}}
{{- if $tag }}:{{ $tag }}{{ end -}}
{{- if .Values.image.digest }}@{{ .Values.image.digest }}{{ end -}}
{{- end -}}

{{/*
Whether this release was installed the old way: into kube-system (or another namespace)
with namespace.create on, creating gpuwarden-system itself. An upgrade of such a release
with no namespace value keeps gpuwarden where it is (docs/operations.md, "Upgrade").
*/}}
{{- define "gpuwarden.oldWay" -}}
{{- if and .Release.IsUpgrade (not .Values.namespace.name) (ne .Release.Namespace "gpuwarden-system") -}}
{{- $old := lookup "v1" "Namespace" "" "gpuwarden-system" -}}
{{- $annotations := dig "metadata" "annotations" dict $old -}}
{{- if and (eq (get $annotations "meta.helm.sh/release-name") .Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") .Release.Namespace) -}}
true
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
gpuwarden's namespace: namespace.name where set, else the release's (helm install -n NS),
else, for a release installed the old way, gpuwarden-system.
*/}}
{{- define "gpuwarden.namespace" -}}
{{- if .Values.namespace.name -}}
{{- .Values.namespace.name -}}
{{- else if include "gpuwarden.oldWay" . -}}
gpuwarden-system
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/*
Whether the release creates (and on uninstall deletes) gpuwarden's namespace.
*/}}
{{- define "gpuwarden.createNamespace" -}}
{{- if or .Values.namespace.create (include "gpuwarden.oldWay" .) }}true{{ end -}}
{{- end -}}

{{/*
The objects of one file copied from deploy/ (files/...), as a YAML list: every document
parsed, comment-only ones dropped, gpuwarden-system replaced by gpuwarden's namespace.
Arguments: (list $ "files/<path>").
*/}}
{{- define "gpuwarden.load" -}}
{{- $root := index . 0 -}}
{{- $path := index . 1 -}}
{{- $text := $root.Files.Get $path | replace "gpuwarden-system" (include "gpuwarden.namespace" $root) -}}
{{- $objects := list -}}
{{- range $doc := regexSplit "(?m)^---[ \\t]*$" $text -1 -}}
{{- $object := fromYaml $doc -}}
{{- if hasKey $object "Error" -}}
{{- fail (printf "%s: %s" $path $object.Error) -}}
{{- end -}}
{{- if $object -}}
{{- $objects = append $objects $object -}}
{{- end -}}
{{- end -}}
{{- toYaml $objects -}}
{{- end -}}

{{/*
A pod template's spec with the image values applied to every container.
Arguments: (list $ $podSpec).
*/}}
{{- define "gpuwarden.podImage" -}}
{{- $root := index . 0 -}}
{{- $spec := index . 1 -}}
{{- range $c := $spec.containers -}}
{{- $_ := set $c "image" (include "gpuwarden.image" $root) -}}
{{- with $root.Values.image.pullPolicy }}{{ $_ := set $c "imagePullPolicy" . }}{{ end -}}
{{- end -}}
{{- with $root.Values.imagePullSecrets }}{{ $_ := set $spec "imagePullSecrets" . }}{{ end -}}
{{- end -}}
